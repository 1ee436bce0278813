"""`scout-ckpt demo`: a real multi-process CPU (gloo) training job with the save hook and fault injection.

launch.run_demo runs the job under torchrun's elastic agent (which starts and restarts it); train.py is one rank;
summary.py reads the outcome back and prints it; model.py, data.py and faults.py are the pieces the job is made of.
Importing this package does not import torch.
"""

from scout_ckpt.demo.faults import Fault, parse, parse_all
from scout_ckpt.demo.launch import run_demo
from scout_ckpt.demo.summary import print_summary

__all__ = ["Fault", "parse", "parse_all", "print_summary", "run_demo"]
