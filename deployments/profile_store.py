"""ProfileStore: the one shared copy of the speculation profiles, keyed by hardware type, versioned.

Routers read their hardware type's profile at start and poll for a newer version; `specserve
profiles push FILE` replaces a profile while the service runs (no restart). A measured profile always
wins over a predicted one (`specserve profile --predict`): at load, and at a push, which is refused for
a predicted profile where a measured one is held. Beside it, per type, the calibrated profile a Router
replica last shared (its grid corrected by its own steps: `profiling.calibration`); a measured or
predicted push drops it (what it corrected is gone). With each poll a Router
also leaves its counters here, so the ingress can serve every replica's series on the API port
(`/metrics`) without knowing where the replicas run.
"""

from __future__ import annotations

from ray import serve

from serve_app.profiling.profiles import Profile, load_profiles, replaces


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class ProfileStore:
    def __init__(self, profiles_dir: str | None):
        self.profiles: dict[str, Profile] = load_profiles(profiles_dir) if profiles_dir else {}
        self.versions: dict[str, int] = {name: 1 for name in self.profiles}
        self.snapshots: dict[str, dict] = {}  # Router replica id -> its counters (see `report`)
        self.calibrated: dict[str, tuple[int, Profile]] = {}  # type -> (version, the last shared calibrated profile)

    def get(self, gpu_type: str) -> tuple[int, dict | None]:
        """(version, profile as a dict) for a hardware type; (0, None) if there is none."""
        prof = self.profiles.get(gpu_type)
        return (self.versions.get(gpu_type, 0), prof.model_dump() if prof else None)

    def push(self, profile: dict) -> int:
        """Validate and store a profile, replacing any for the same hardware type; returns its version.
        A predicted profile where a measured one is held is refused (ValueError): a model never
        overrides a measurement. A measured one always replaces."""
        prof = Profile.model_validate(profile)
        if prof.source == "calibrated":
            return self.share(profile)
        held = self.profiles.get(prof.gpu_type)
        if not replaces(held, prof):
            raise ValueError(f"a measured profile for {prof.gpu_type} (created {held.created}) is in use; a predicted "
                             "one does not replace it (push a measured profile to update it)")
        self.profiles[prof.gpu_type] = prof
        self.versions[prof.gpu_type] = self.versions.get(prof.gpu_type, 0) + 1
        self.calibrated.pop(prof.gpu_type, None)
        return self.versions[prof.gpu_type]

    def share(self, profile: dict, base_version: int | None = None) -> int:
        """A Router replica's calibrated profile for its type (the newest replaces the last); its version.
        `base_version`, the version of the profile it was calibrated against: a share made against a
        profile that has since been replaced is dropped (0), else a push racing a Router's share would
        leave the old calibration beside the new measurement."""
        prof = Profile.model_validate(profile)
        if prof.source != "calibrated":
            raise ValueError("share takes a calibrated profile; push measured or predicted ones")
        if base_version is not None and base_version != self.versions.get(prof.gpu_type, 0):
            return 0
        version = self.calibrated.get(prof.gpu_type, (0, None))[0] + 1
        self.calibrated[prof.gpu_type] = (version, prof)
        return version

    def get_calibrated(self, gpu_type: str) -> tuple[int, dict | None]:
        """(version, calibrated profile as a dict) shared for a hardware type; (0, None) if none."""
        version, prof = self.calibrated.get(gpu_type, (0, None))
        return version, prof.model_dump() if prof else None

    def list(self) -> dict[str, int]:
        return dict(self.versions)

    def report(self, replica: str, snapshot: dict) -> None:
        """A Router replica's latest counters and gauges (kept after it dies: counters stay monotonic)."""
        self.snapshots[replica] = snapshot

    def metrics(self) -> dict[str, dict]:
        return dict(self.snapshots)
