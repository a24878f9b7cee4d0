"""The training data under a plan: the uneven (and cost-aware) samplers and loaders, the streams, and the plan in
force that they run.
"""
