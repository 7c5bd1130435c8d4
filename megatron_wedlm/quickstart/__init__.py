"""The quickstart: tiny corpus -> tokenizer -> data -> AR and WeDLM training -> evaluation -> report,
driving the real entry points as subprocesses (``tools/quickstart.py``; see the README).

A regular package (not a namespace one), so ``find_packages`` installs it and the layering
check (``.importlinter``) sees it.
"""
