"""The parts of ``benchmarks/gpu_stack.py``, the stack comparison on a GPU host.

- ``plan``: the plans (tiny, default, full), their order and their estimate.
- ``assets``: the model folder, the adapter families, the tenants file.
- ``pushes``: the local S3 server and timed ``loraplex adapters push``.
- ``serve_config``: deploy/h200.yaml with this host's needs, and the engine arguments it gives.
- ``systems``: how each system is started; ``engine_alone``: the in-process engine's child job.
- ``routes``: the routing check (hooks on the routers, a vLLM plugin).
- ``runner``: the blocks run in order; ``models``: the records; ``targets``, ``output``: tables,
  JSON and plot; ``host``: versions and hardware.
"""
