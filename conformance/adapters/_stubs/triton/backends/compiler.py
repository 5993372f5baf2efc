"""Stand-in ``triton.backends.compiler`` (torch imports the module; no AttrsDescriptor, no GPUTarget)."""
