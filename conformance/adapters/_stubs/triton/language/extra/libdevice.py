"""Stand-in ``triton.language.extra.libdevice`` (SGLang's int8/fp8 kernels import it; nothing is called)."""
