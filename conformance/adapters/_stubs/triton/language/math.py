"""Stand-in ``triton.language.math`` (torch aliases it as ``libdevice``; nothing is called)."""
