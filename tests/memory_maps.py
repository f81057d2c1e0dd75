"""This process's memory mappings as Linux's /proc/self/smaps describes them."""

HUGE_PAGE = 2 << 20


def vm_flags_at(address):
    """The VmFlags of this process's mapping that holds `address` (Linux)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def first_huge_page(tensor):
    """The address of the first whole 2 MB page inside a tensor's bytes."""
    start = tensor.data_ptr()
    inner = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    assert inner + HUGE_PAGE <= start + tensor.numel() * tensor.element_size(), "no whole huge page inside"
    return inner
