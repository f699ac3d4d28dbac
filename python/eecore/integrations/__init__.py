"""eecore's ops inside other engines (drop-in kernels): see `eecore.integrations.transformers`."""
