"""The harness: the driver, the adapters (reference, vLLM, impl) and the runs that compare them
(replay, lockstep, refinement), with the report and the environment it runs in."""
