"""Tools on top of the harness: case authoring, generators, shrink, mutation testing, the
historical-bug corpus, the capture engine, stats, doctor, show and the spec export."""
