"""Stand-in ``triton.compiler.compiler`` (torch imports the module; no AttrsDescriptor)."""
