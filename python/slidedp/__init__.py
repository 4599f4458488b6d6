"""slidedp: full-parameter fine-tuning of LLMs whose state lives in host memory."""

from slidedp._native import __version__
from slidedp.errors import SlidedpError

__all__ = ["SlidedpError", "__version__"]
