"""Task heads, losses and one small module per cross-lingual transfer method
(zero-shot / translate-train, FILTER, X-Mixup, VECO, XLA). Built in later issues."""
