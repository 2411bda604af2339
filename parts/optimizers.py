# TEMPORARY: the optimizers helper writes NorMuon and DistAdam here; spliced into train_gpt.py later.
