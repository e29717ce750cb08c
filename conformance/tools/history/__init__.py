"""The historical-bug corpus: every upstream bug of the partial-tail path, re-found."""
