"""The torch.optim contract and the optimizer's diagnostics."""
