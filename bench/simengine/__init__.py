"""`kvplane sim-engine`: a simulated vLLM engine with real NIXL, for development, tests and benchmarks.

Entry points: ``serve(settings, observer)`` and ``SimEngineServer`` (app.py),
``SimEngineSettings`` with ``build_arg_parser`` / ``settings_from_args``
(settings.py), and the node-agent seam ``EngineObserver`` / ``EngineControl``
(engine_hooks.py).
"""
