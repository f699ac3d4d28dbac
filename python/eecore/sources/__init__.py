"""Local text, with no downloads: the installed packages' Python source and descriptions as a corpus
(`corpus`), and requests made from them (`chat_prompts`) or from a topic list
(`general_chat_prompts`). Training reads them as data, evaluation as held-out prompts."""
