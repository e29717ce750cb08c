"""Reference model of vLLM 0.33's MooncakeStore connector (pure Python, no vLLM or torch).

What it mirrors, module by module:

- ``config``: the connector's static view of the engine (store groups, lcm, h, partial hits,
  EAGLE margins) and its role (``MooncakeStoreScheduler.__init__``, MS:138-205).
- ``meta``: per-request tracker, store jobs and load specs (``data.py`` MD:690-865).
- ``masks``: which chunks of each group the store writes and probes (``store_mask`` /
  ``lookup_mask``, MCO:278-382; a sliding window keeps only the blocks a hit needs).
- ``tail``: attention tail puts of a partial tail (``_partial_tail_non_mamba_puts`` MS:62-132).
- ``scheduler``: jobs, pins and finish-time hand-offs (``build_connector_meta`` MS:304-525,
  ``_reference_save_blocks`` MS:550-598, ``register_finished_partial_tail`` MS:600-670,
  ``_handle_boundary_state_offloads`` MS:672-727, ``update_connector_output`` MS:729-751).
- ``store``: an in-memory store whose put outcomes are scripted by the trace.
- ``verification``: the verified-load rule (a tailproof deviation: vLLM serves what it gets):
  under an engine's own key a value is valid or corrupt; a corrupt one fails the load closed
  and is removed, whatever the failure kind.
- ``worker``: one rank's sending thread (``KVCacheStoreSendingThread._handle_request``,
  MW:727-1045) and ledger retirement (``_close_ended_store_requests`` MW:2063-2085).
- ``lookup``: store-side lookup (``MooncakeStoreWorker.lookup`` MW:2095-2255 over
  ``MooncakeStoreCoordinator`` MCO:391-510) and the scheduler-side arbitration
  (``get_num_new_matched_tokens`` MS:210-265, ``Scheduler.schedule`` SC:1129-1190).

The GPU block pool it pins is the reference core's ``BlockPool`` (``touch`` / ``free_blocks``
with vLLM's semantics); the connector only ever sees block ids.
"""
