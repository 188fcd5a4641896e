"""Options of the embedded ``local`` backend (``backend_config`` when ``backend: local``)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from ascendstore.config import Bool, ByteSize
from ascendstore.contract import BackendOptions

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class LocalOptions(BackendOptions):
    """One shared-memory pool per ``name`` on a node; every process that opens the
    same name with the same options sees the same objects."""

    name: str = Field(
        "ascendstore",
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}$",
        description="pool name; the segment is /dev/shm/ascendstore-pool.<name>. Different names = different pools",
    )
    capacity: ByteSize = Field(
        1 * GiB,
        description="DRAM bytes for object data (rounded down to whole pages); memory is taken as used",
    )
    page_size: ByteSize = Field(
        64 * KiB, description="allocation unit: objects occupy whole pages (power of two, 4 KiB..64 MiB)"
    )
    max_keys: int = Field(
        0, ge=0, le=1 << 26, description="key slots (DRAM + disk objects); 0: 2*pages + disk_capacity/256KiB"
    )
    checksum: Bool = Field(
        False,
        description="checksum objects on put, verify on get (mismatch -> CORRUPT); costs ~10-25% put/get throughput",
    )
    disk_path: str | None = Field(
        None, description="directory of the disk tier (spill on eviction); None: off"
    )
    disk_capacity: ByteSize = Field(
        0, description="bound on the disk tier's file bytes (required with disk_path)"
    )
    disk_segment_size: ByteSize = Field(
        0, description="size of one append-only disk segment file; 0: disk_capacity/16 within 4 MiB..256 MiB"
    )
    unlink_on_last_close: Bool = Field(
        True, description="the last process to close the pool removes its shared memory and disk files"
    )
    prefault: Bool = Field(
        False, description="allocate all of the capacity's memory when the pool is created; on /dev/shm in 2 MiB "
        "pages where the kernel makes them (MADV_COLLAPSE, Linux 6.1+), whatever the mount's huge="
    )
    lazy_huge_pages: Bool = Field(
        True, description="a pool of 1 GiB or more that is not prefaulted, on a /dev/shm mounted huge=never: a "
        "thread has the kernel make each 2 MiB stretch one 2 MiB page just before the pool's fill reaches it "
        "(MADV_COLLAPSE, Linux 6.1+), off the puts' path; memory is still taken as used. Every process that opens "
        "the pool runs one; one live process at a time does the work, another takes over when it is gone"
    )
    hugetlbfs: str | None = Field(
        None,
        description="a hugetlbfs mount (e.g. /dev/hugepages) to hold the DRAM tier in reserved huge pages "
        "instead of /dev/shm: fewer TLB misses on large objects; needs capacity's worth of pages reserved "
        "(vm.nr_hugepages); every process of the pool must give the same; None: /dev/shm (in transparent "
        "huge pages where it is mounted huge=advise, else 4 KiB ones)",
    )
    open_timeout_s: float = Field(
        10.0,
        gt=0,
        description="bound on waiting for another process creating the pool while it shows no progress "
        "(a creator at work is waited for however long it takes, one that died is replaced at once)",
    )

    @field_validator("page_size")
    @classmethod
    def _page_size(cls, v: int) -> int:
        if v < 4 * KiB or v > 64 * MiB or v & (v - 1):
            raise ValueError("page_size must be a power of two between 4KiB and 64MiB")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LocalOptions:
        if self.capacity < self.page_size:
            raise ValueError(
                f"capacity ({self.capacity} bytes) must hold at least one page ({self.page_size})"
            )
        if self.capacity // self.page_size >= 1 << 31:
            raise ValueError("capacity/page_size must stay below 2**31 pages; raise page_size")
        if self.disk_path is not None and self.disk_capacity == 0:
            raise ValueError("disk_path is set: also set disk_capacity (e.g. 64GiB)")
        return self

    @property
    def pages(self) -> int:
        return self.capacity // self.page_size

    @property
    def effective_max_keys(self) -> int:
        if self.max_keys:
            return self.max_keys
        disk = self.disk_capacity // (256 * KiB) if self.disk_path else 0
        return max(1024, min(2 * self.pages + disk, 1 << 24))

    @property
    def effective_segment_size(self) -> int:
        if self.disk_segment_size:
            return self.disk_segment_size
        return min(max(self.disk_capacity // 16, 4 * MiB), 256 * MiB)
