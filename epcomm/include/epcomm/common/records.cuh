// Call records: the fixed-width structs a library entry point takes instead of dozens of positional
// arguments, filled by Python through ctypes mirrors. A mirror that drifts from its struct would
// make every call pass garbage, so each library exports the layout and field names of its records
// (write_record_layout, record_field_name below) and the loader compares them with the mirrors
// (backends/cuda/capi.py, check_struct_layout). Host code only; never includes torch.
//
// A record's fields are fixed-width (device addresses as uint64, flags as int32: no bool), grouped
// by width with the padding spelled out, so the layout reads the same on both sides.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace epcomm {

struct FieldLayout {
    int64_t offset, size;
    const char* name;
};

// Every field of call record S, in declaration order: specialised next to each record, listing
// EPCOMM_FIELD(f) for each field f in a scope where S names the record.
template <class S>
constexpr auto fields_of();

#define EPCOMM_FIELD(f) \
    ::epcomm::FieldLayout{static_cast<int64_t>(offsetof(S, f)), static_cast<int64_t>(sizeof(S::f)), #f}

// Each field starts where the one before it ends and the last ends at sizeof(S): no implicit
// padding, and fields_of<S> misses no field and keeps their order (what the ctypes check relies on).
template <class S>
constexpr bool lists_every_field() {
    int64_t end = 0;
    for (const FieldLayout& f : fields_of<S>()) {
        if (f.offset != end) return false;
        end += f.size;
    }
    return end == static_cast<int64_t>(sizeof(S));
}

struct RecordLayout {
    const char* name;
    int64_t size;
    const FieldLayout* fields;
    int num_fields;
};

// Where record_layout's field lists live (static storage, so a table of records is constant).
// The helpers here are static, like the rest of the libraries' host helpers: the IPC and NVSHMEM
// libraries both include this header and may be loaded in one process, so none of it is exported.
template <class S>
static constexpr auto kRecordFields = fields_of<S>();

template <class S>
static constexpr RecordLayout record_layout(const char* name) {
    static_assert(lists_every_field<S>(), "a call record has implicit padding, or fields_of misses a field");
    return {name, sizeof(S), kRecordFields<S>.data(), static_cast<int>(kRecordFields<S>.size())};
}

template <std::size_t N>
static const RecordLayout* find_record(const RecordLayout (&records)[N], const char* name) {
    for (const RecordLayout& r : records)
        if (std::strcmp(r.name, name) == 0) return &r;
    return nullptr;
}

// The layout of record `name` of `records`: its sizeof, then the offset and size of each field in
// declaration order. Writes at most `max` values and returns how many the layout has (-1: no such
// record), so a caller expecting fewer sees it. What a library's *_struct_layout export returns.
template <std::size_t N>
static int write_record_layout(const RecordLayout (&records)[N], const char* name, int64_t* out, int max) {
    const RecordLayout* r = find_record(records, name);
    if (r == nullptr) return -1;
    auto put = [&](int i, int64_t v) {
        if (i < max) out[i] = v;
    };
    put(0, r->size);
    for (int f = 0; f < r->num_fields; ++f) {
        put(1 + 2 * f, r->fields[f].offset);
        put(2 + 2 * f, r->fields[f].size);
    }
    return 1 + 2 * r->num_fields;
}

// Field `index` of record `name` of `records` by name (nullptr past the last): two fields of one
// type swapped on one side keep the layout but not the meaning. What *_struct_field_name returns.
template <std::size_t N>
static const char* record_field_name(const RecordLayout (&records)[N], const char* name, int index) {
    const RecordLayout* r = find_record(records, name);
    return r != nullptr && index >= 0 && index < r->num_fields ? r->fields[index].name : nullptr;
}

// A record's device address as the pointer type of the kernel argument it fills.
template <class T>
static void set_ptr(T*& field, uint64_t address) {
    field = reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

}  // namespace epcomm
