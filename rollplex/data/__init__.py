"""Video-R1 data: records (``records``), media decoding (``vision``), synthetic generator (``synth``)."""

from rollplex.data.records import DatasetError, load_records, media_path
from rollplex.data.synth import SynthSummary, generate_dataset
from rollplex.data.vision import ImageSampling, MediaError, VideoSampling, read_image, read_video

__all__ = [
    "DatasetError",
    "ImageSampling",
    "MediaError",
    "SynthSummary",
    "VideoSampling",
    "generate_dataset",
    "load_records",
    "media_path",
    "read_image",
    "read_video",
]
