"""Results that travel: ``featcache export`` writes a results table in the formats other tools
and leaderboards read (CLIP_benchmark, MTEB/MIEB, lm-evaluation-harness, the Hugging Face model
card's model-index); ``featcache import`` reads published results (those formats and timm's
results CSVs) into a results table as external rows. A format is one module registered in
:data:`~featcache.interop.formats.RESULT_FORMATS`."""

from featcache.interop.export import ExportConfig, ExportReport, export_results
from featcache.interop.formats import RESULT_FORMATS, ResultFormat
from featcache.interop.import_ import ImportConfig, ImportReport, import_results, read_external

__all__ = [
    "RESULT_FORMATS",
    "ExportConfig",
    "ExportReport",
    "ImportConfig",
    "ImportReport",
    "ResultFormat",
    "export_results",
    "import_results",
    "read_external",
]
