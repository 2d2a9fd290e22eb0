"""Built-in tools: `calculator` (safe arithmetic) and `python` (a sandboxed interpreter); see BUILTIN_TOOLS."""
