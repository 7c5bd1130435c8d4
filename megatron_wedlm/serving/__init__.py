"""An OpenAI-compatible server for WeDLM checkpoints (``inference/serve.py``): the engine
(:mod:`.engine`), request bodies, HTTP endpoints (:mod:`.app`), streamed text, scoring, metrics.
"""
