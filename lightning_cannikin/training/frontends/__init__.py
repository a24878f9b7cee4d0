"""Where a step's pieces happen: the Lightning strategies (DDP, FSDP2, Ray Train) with their callback, and the
Fabric strategy, each driving the engine through its step API; and what they check before a fit.
"""
