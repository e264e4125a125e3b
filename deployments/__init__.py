"""Ray Serve wiring for specserve (DraftWorker / TargetWorker actors, Router, ProfileStore, ingress).

The actors will host `serve_app.engine.worker.ModelWorker`, which already holds everything one model needs
(its KV state and the propose / verify / commit half of a step); the engine's step loop is what the
Router runs across them.
"""
