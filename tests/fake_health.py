"""A fake hardware-health source for the observer tests, named by "module:factory" (the observer imports it;
nothing is pickled). Torch-free: the observer process must not pay for torch."""

from __future__ import annotations


class FakeEccSource:
    """Reports the uncorrectable ECC count going from 0 to 1 at poll number `at`, as NVML's diff would. With
    `count_file`, each poll first writes its number there (atomically), so a test can wait for the observer to have
    polled N times instead of sleeping."""

    def __init__(self, at: int = 2, gpu: int = 0, count_file: str | None = None):
        self.polls, self.at, self.gpu, self.count_file = 0, at, gpu, count_file

    def poll(self) -> list[dict]:
        self.polls += 1
        if self.count_file:
            import os

            tmp = f"{self.count_file}.tmp"
            with open(tmp, "w") as f:
                f.write(str(self.polls))
            os.replace(tmp, self.count_file)
        if self.polls == self.at:
            return [
                {
                    "metric": "ecc_uncorrected_volatile",
                    "gpu": self.gpu,
                    "old": 0,
                    "new": 1,
                    "severity": "fatal",
                    "message": f"GPU {self.gpu}: ecc_uncorrected_volatile 0 -> 1",
                }
            ]
        return []


class FakeEccWhenFileAppears:
    """Reports the uncorrectable ECC count going from 0 to 1 once, at the first poll after `path` exists: the
    training script decides when the fault strikes (between two saves), the observer reports it as NVML would."""

    def __init__(self, path: str, gpu: int = 0):
        self.path, self.gpu, self.fired = path, gpu, False

    def poll(self) -> list[dict]:
        import os

        if self.fired or not os.path.exists(self.path):
            return []
        self.fired = True
        return [
            {
                "metric": "ecc_uncorrected_volatile",
                "gpu": self.gpu,
                "old": 0,
                "new": 1,
                "severity": "fatal",
                "message": f"GPU {self.gpu}: ecc_uncorrected_volatile 0 -> 1",
            }
        ]
