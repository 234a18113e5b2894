"""Training: flow-matching SFT of the demo model (`pretrain`); the RL trainer comes next."""
