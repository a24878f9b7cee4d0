"""What a step measures and carries: the step timer, the weighted reductions and the noise statistics riding on
them, the loss's weights, and each rank's own evidence for the next re-plan.
"""
