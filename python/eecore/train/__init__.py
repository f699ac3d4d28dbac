"""Training recipes: CALM's exit classifier (eecore.train.calm_classifier)."""
