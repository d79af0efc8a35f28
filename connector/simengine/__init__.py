"""`kvplane sim-engine`: a simulated vLLM engine with real NIXL, for development, tests and benchmarks.

Entry points: ``main`` (command.py, `kvplane sim-engine`), ``serve(settings, observer)`` and
``SimEngineServer`` (app.py),
``SimEngineSettings`` with ``build_arg_parser`` / ``settings_from_args``
(settings.py), and the node-agent seam ``EngineObserver`` / ``EngineControl``
(engine_hooks.py).
"""
