"""Evaluating a decoding strategy against full depth (`eecore eval`): the prompt sets (`prompts`,
`prompt_sets`), the runs (`strategies`), the metrics (`metrics`, with ROUGE-L from eecore.text.rouge)
and the report (`report`)."""
