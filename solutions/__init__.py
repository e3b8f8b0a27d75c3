"""Validated solutions to the chapters' exercises, one module per chapter (``chNN_topic.py``).

A notebook's exercise cell is linked to an attribute here by ``@exercise("chNN_topic.name")``; in
solution mode (``KERNEL_LADDER_SOLUTIONS=1``) the stub is replaced by that attribute.
"""
