"""`scout-ckpt demo`: a real multi-process CPU (gloo) training job with the save hook and fault injection.

supervisor.run_demo starts and restarts the job; train.py is one rank; model.py, data.py and faults.py are the
pieces it is made of. Importing this package does not import torch.
"""

from scout_ckpt.demo.faults import Fault, parse, parse_all
from scout_ckpt.demo.supervisor import print_summary, run_demo

__all__ = ["Fault", "parse", "parse_all", "print_summary", "run_demo"]
