"""Training recipes: CALM's exit classifier (eecore.train.calm_classifier) and LayerSkip's layer dropout + early-exit loss (eecore.train.layerskip)."""
