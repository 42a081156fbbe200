"""Data-parallel replicas of a pipeline stage: LocalSGD/DiLoCo averaging (`averaging`) and optimizer state
sharded across a stage's replicas (`sharded_optimizer`, ZeRO-1). Pure PyTorch over the transport layer."""
