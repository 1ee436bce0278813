"""What each command of the command line does with the library's answer: the text or JSON it prints, the lines
on stderr, and the exit code it returns (0, or 1 when the thing asked about is not clean / not found / failed).

Why a wing of its own: cli.py is the command line's contract -- the commands' names, arguments, options and help,
and the mapping of errors to exit codes -- and stays a thin typer layer; the bodies here are plain functions
(options in, exit code out) that never see typer. By what they may touch: `read` (ls, explain, resume, report:
they never write a ROOT and never import torch), `maintain` (certify, gc, quarantine, release, adopt, export,
ledger rebuild, demo: they change a ROOT or run a job), `output` (JSON, the rich console, sizes, the progress bar).
"""
