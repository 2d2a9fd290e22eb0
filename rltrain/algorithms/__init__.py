"""RL algorithm pieces that are pure tensor functions: advantage estimators (policy losses live in the kernel
layer, `rltrain_kernels.fused_policy_loss`)."""
