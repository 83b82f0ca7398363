// A read-only record bound from one field table, so that each field is named once: the table gives
// the class's attributes, as_dict() (the fields in order; sequences as lists), __repr__, equality
// and hashing by value, and pickling (the fields' values in order). Used for what the engine
// reports of itself (LinkInfo, EngineStats, PoolInfo; bind_types.cc).
//
// Contract: the records are plain values copied out of the engine; nothing here locks or releases
// the GIL. A record has no public constructor: Python gets them from the engine (and pickle).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace pdlink::bindings {

// One field of a record: its Python name and its member.
template <class C, class T>
struct Field {
  const char* name;
  T C::* member;
};

template <class C, class T>
constexpr Field<C, T> field(const char* name, T C::* member) {
  return {name, member};
}

namespace record_detail {
// A field's value as an attribute (and in the state that compares, hashes and pickles): sequences
// as tuples, so a record is immutable and hashable.
template <class T>
pybind11::object attribute(const T& v) {
  return pybind11::cast(v);
}
template <class T>
pybind11::object attribute(const std::vector<T>& v) {
  return pybind11::tuple(pybind11::cast(v));
}
}  // namespace record_detail

// Binds C as a read-only record named `name` with `fields` (a tuple of Field<C, T>), in order.
template <class C, class... T>
pybind11::class_<C> bindRecord(pybind11::module_& m, const char* name, std::tuple<Field<C, T>...> fields) {
  namespace py = pybind11;
  auto state = [fields](const C& c) {
    return std::apply([&c](const auto&... f) { return py::make_tuple(record_detail::attribute(c.*(f.member))...); },
                      fields);
  };
  py::class_<C> cls(m, name);
  std::apply(
      [&cls](const auto&... f) {
        (cls.def_property_readonly(f.name,
                                   [member = f.member](const C& c) { return record_detail::attribute(c.*member); }),
         ...);
      },
      fields);
  cls.def("as_dict",
          [fields](const C& c) {
            py::dict d;
            std::apply([&](const auto&... f) { ((d[f.name] = py::cast(c.*(f.member))), ...); }, fields);
            return d;
          })
      .def("__eq__",
           [state](const C& a, py::object b) {
             return py::isinstance<C>(b) && state(a).equal(state(b.cast<const C&>()));
           })
      .def("__hash__", [state](const C& c) { return py::hash(state(c)); })
      .def("__repr__",
           [fields, state, name = std::string(name)](const C& c) {
             py::tuple values = state(c);
             std::string text = name + "(";
             size_t i = 0;
             std::apply(
                 [&](const auto&... f) {
                   ((text +=
                     std::string(i ? ", " : "") + f.name + "=" + py::repr(values[i]).template cast<std::string>(),
                     ++i),
                    ...);
                 },
                 fields);
             return text + ")";
           })
      .def(py::pickle(state, [fields, name = std::string(name)](const py::tuple& t) {
        if (t.size() != sizeof...(T)) {
          throw py::value_error("a " + name + "'s state has " + std::to_string(sizeof...(T)) + " fields");
        }
        C c{};
        size_t i = 0;
        std::apply(
            [&](const auto&... f) {
              ((c.*(f.member) = t[i++].template cast<std::decay_t<decltype(c.*(f.member))>>()), ...);
            },
            fields);
        return c;
      }));
  return cls;
}

}  // namespace pdlink::bindings
