"""Pipeline parallelism: the stage split, the AFAB / 1F1B / interleaved schedules, and p2p."""
from picotron.pipeline_parallel.engine import pipeline_train_step  # noqa: F401
from picotron.pipeline_parallel.stage import apply_pipeline_parallel, describe_split  # noqa: F401
