"""An OpenAI-compatible server for WeDLM checkpoints (``inference/serve.py``).

:mod:`.engine` is the continuous batch the requests share, :mod:`.openai_api` the request bodies,
:mod:`.app` the HTTP endpoints, :mod:`.text_stream` the streamed text, :mod:`.scoring`
``logprobs`` and ``echo``, :mod:`.metrics` ``/metrics``; ``page.html`` is the page at ``/``.
"""
