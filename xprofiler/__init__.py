"""xprofiler: measure a machine once and describe models.

Importing this package does not import torch: the contracts (ModelSpec, HardwareProfile)
are read by the simulator and scheduler, which must run without torch.
"""

from xprofiler.profile import BandwidthCurve, Fingerprint, HardwareProfile, LayerFit
from xprofiler.specs import ModelSpec, get_model_spec, model_names

__all__ = ["BandwidthCurve", "Fingerprint", "HardwareProfile", "LayerFit", "ModelSpec", "get_model_spec",
           "model_names"]
