"""``slidedp profile layer``: every activation-layout candidate of one decoder layer, measured."""
