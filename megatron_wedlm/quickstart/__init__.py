"""The quickstart: built-in data -> tokenizer -> AR and WeDLM training -> evaluation -> report,
driving the real entry points as subprocesses (``tools/quickstart.py``). A regular package, so
``find_packages`` and ``.importlinter`` see it.
"""
