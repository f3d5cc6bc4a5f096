// Call records: the fixed-width structs a library entry point takes instead of dozens of positional
// arguments, filled by Python through ctypes. Each is declared once, as a field list (EPCOMM_RECORD),
// which gives the struct and its field table; each library exports the tables (write_record_layout,
// record_field_name, record_field_type below) and the loader builds its ctypes structures from them
// (backends/cuda/capi.py, load_records). Host code only; never includes torch.
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
    const char* type;  // the C type as written: a fixed-width integer, or another record's name
};

// Every field of call record S, in declaration order (EPCOMM_RECORD specialises it).
template <class S>
constexpr auto fields_of();

#define EPCOMM_RECORD_MEMBER(type, name) type name;
#define EPCOMM_RECORD_FIELD(type, name)                                                                \
    ::epcomm::FieldLayout{static_cast<int64_t>(offsetof(S, name)), static_cast<int64_t>(sizeof(S::name)), \
                          #name, #type},

// Declares record `Name` (in namespace epcomm) from FIELDS(X), a list of X(type, name): the struct
// and its field table, so a field is added in one place.
#define EPCOMM_RECORD(Name, FIELDS)                           \
    struct Name {                                             \
        FIELDS(EPCOMM_RECORD_MEMBER)                          \
    };                                                        \
    template <>                                               \
    constexpr auto fields_of<Name>() {                        \
        using S = Name;                                       \
        return std::array{FIELDS(EPCOMM_RECORD_FIELD)};       \
    }

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

// The C type of field `index` of record `name` (nullptr past the last). What *_struct_field_type returns.
template <std::size_t N>
static const char* record_field_type(const RecordLayout (&records)[N], const char* name, int index) {
    const RecordLayout* r = find_record(records, name);
    return r != nullptr && index >= 0 && index < r->num_fields ? r->fields[index].type : nullptr;
}

// Exports `records` (extern "C") as <prefix>_layout, <prefix>_field_name and <prefix>_field_type, the
// three functions above, for the loader to build its ctypes structures from.
#define EPCOMM_EXPORT_RECORDS(prefix, records)                                                  \
    extern "C" int prefix##_layout(const char* name, int64_t* out, int max) {                  \
        return ::epcomm::write_record_layout(records, name, out, max);                         \
    }                                                                                          \
    extern "C" const char* prefix##_field_name(const char* name, int index) {                  \
        return ::epcomm::record_field_name(records, name, index);                              \
    }                                                                                          \
    extern "C" const char* prefix##_field_type(const char* name, int index) {                  \
        return ::epcomm::record_field_type(records, name, index);                              \
    }

// A record's device address as the pointer type of the kernel argument it fills.
template <class T>
static void set_ptr(T*& field, uint64_t address) {
    field = reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

}  // namespace epcomm
