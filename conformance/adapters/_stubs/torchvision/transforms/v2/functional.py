"""Stand-in ``torchvision.transforms.v2.functional`` (imported by transformers; nothing is called)."""
