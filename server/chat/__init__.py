"""DeepSeek's chat format: the template, reasoning split, DSML tool calls, grammars."""
