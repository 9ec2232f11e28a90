"""One small exception family. Messages say what was asked and what was found."""


class KilnError(Exception):
    """Base of every error kiln raises on purpose; the CLI prints its message as one line."""


class ConfigError(KilnError):
    """params.yaml (or a file it names) is unusable."""


class DataError(KilnError):
    """The corpus could not be read, cleaned, split or versioned."""


class TrainError(KilnError):
    """The model could not be trained or loaded."""


class ExportError(KilnError):
    """The ONNX export failed or missed parity with PyTorch."""


class BuildError(KilnError):
    """An engine could not be built."""


class BackendUnavailable(KilnError):
    """The backend asked for cannot run on this machine."""


class GateFailed(KilnError):
    """An engine failed a gate; carries the report so callers can print the numbers."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


class RegistryError(KilnError):
    """The model registry is unreachable or refused an operation."""


class VersionRefused(RegistryError):
    """A registered version failed a loader check (gates, sha256, engine.json, backend) and is not served."""


class EngineError(KilnError):
    """An engine directory is corrupt, or its engine cannot be loaded or run here."""


class ShapeOutOfProfile(KilnError):
    """A request does not fit the engine's optimization profiles (too long, too big a batch)."""
