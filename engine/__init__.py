"""pdserve's engine: block pool, scheduler and model runner shared by both pools."""
