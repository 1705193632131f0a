// Historical Embedding Cache (DistGNN-MB HEC) bookkeeping: the ring of cache lines and
// the tag directory. Feature rows live in a torch tensor on the Python side; this module
// only decides which slot each row goes to and which slot a tag hits.
//
// Semantics (docs in hpcgnn/cache/hec.py):
// - ring of `capacity` slots, written at a moving pointer: oldest line first (FIFO);
// - directory: open-addressing hash table (linear probing, backward-shift deletion,
//   load factor <= 1/2) tag -> slot, holding only valid lines; re-storing a resident
//   tag writes a new slot and invalidates the old one;
// - ageing: each store call first advances a clock (every line ages by one), new lines
//   get the new clock; age = clock - insertion clock. A line hits iff it is resident and
//   (never_expire or age <= life_span).
#include "common.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <mutex>

namespace hpcgnn {
namespace {

constexpr int64_t kNone = -1;

// Open-addressing map int64 tag (>= 0) -> int64 value. Linear probing, no tombstones;
// key and value share a cache line.
class TagTable {
  public:
    explicit TagTable(int64_t max_entries) {
        uint64_t cap = 16;
        while (cap < static_cast<uint64_t>(2 * max_entries)) cap <<= 1;
        slots_.assign(cap, Entry{kNone, kNone});
        mask_ = cap - 1;
    }
    int64_t size() const { return size_; }
    int64_t find(int64_t key) const {
        uint64_t h = home(key);
        while (true) {
            const Entry& en = slots_[h];
            if (en.key == key) return en.val;
            if (en.key == kNone) return kNone;
            h = (h + 1) & mask_;
        }
    }
    // Insert or overwrite; returns the previous value (kNone if absent).
    int64_t put(int64_t key, int64_t val) {
        uint64_t h = home(key);
        while (slots_[h].key != kNone) {
            if (slots_[h].key == key) {
                const int64_t old = slots_[h].val;
                slots_[h].val = val;
                return old;
            }
            h = (h + 1) & mask_;
        }
        slots_[h] = Entry{key, val};
        ++size_;
        return kNone;
    }
    void erase(int64_t key) {
        uint64_t i = home(key);
        while (slots_[i].key != key) {
            if (slots_[i].key == kNone) return;
            i = (i + 1) & mask_;
        }
        // Backward-shift deletion: pull later entries of the probe run into the hole.
        uint64_t j = i;
        while (true) {
            j = (j + 1) & mask_;
            if (slots_[j].key == kNone) break;
            const uint64_t h = home(slots_[j].key);
            // Entry j may move to i iff its home is not cyclically within (i, j].
            const bool in_range = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
            if (!in_range) {
                slots_[i] = slots_[j];
                i = j;
            }
        }
        slots_[i] = Entry{kNone, kNone};
        --size_;
    }
    void clear() {
        std::fill(slots_.begin(), slots_.end(), Entry{kNone, kNone});
        size_ = 0;
    }

  private:
    struct Entry {
        int64_t key, val;
    };
    uint64_t home(int64_t key) const { return mix64(static_cast<uint64_t>(key)) & mask_; }
    std::vector<Entry> slots_;
    uint64_t mask_ = 0;
    int64_t size_ = 0;
};

class CacheDirectory {
  public:
    // `max_rows` (0 = capacity) bounds the storage rows: valid lines never exceed the number
    // of distinct tags that can arrive, so a cache of the rank's halo vertices needs at most
    // min(capacity, halo) rows however large the ring is. Every slot maps to a storage row;
    // rows of evicted or replaced lines are reused (last freed first).
    CacheDirectory(int64_t capacity, int64_t life_span, bool never_expire, int64_t hist_bins,
                   int64_t max_rows)
        : cap_(capacity), ls_(life_span), never_expire_(never_expire),
          max_rows_(max_rows > 0 ? std::min(max_rows, capacity) : capacity), table_(capacity) {
        require(capacity >= 1, "cache: capacity must be >= 1");
        require(life_span >= 0, "cache: life_span must be >= 0");
        require(hist_bins >= 1, "cache: hist_bins must be >= 1");
        require(max_rows >= 0, "cache: max_rows must be >= 0");
        slot_tag_.assign(capacity, kNone);
        slot_clock_.assign(capacity, 0);
        slot_row_.assign(capacity, kNone);
        hist_.assign(hist_bins, 0);
    }

    // One received message: age every line by one, then place the rows. Returns
    // (rows, slots, storage): row rows[j] of the message goes to ring slot slots[j], kept in
    // storage row storage[j]. Duplicate tags keep their last row; if more than `capacity`
    // distinct tags arrive, the last `capacity` of them (by last occurrence) are kept.
    py::tuple store(carray<int64_t> tags) {
        require(tags.ndim() == 1, "cache: tags must be 1-D");
        const int64_t n = tags.shape(0);
        const int64_t* t = tags.data();
        std::vector<int64_t> rows, slots, storage;
        {
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> guard(mu_);
            for (int64_t i = 0; i < n; ++i)
                if (t[i] < 0) throw std::invalid_argument("cache: tags must be >= 0, got " + std::to_string(t[i]));
            // Storage rows needed: lines resident after the store <= resident now + new tags.
            {
                TagTable fresh(std::max<int64_t>(n, 1));
                int64_t extra = 0;
                for (int64_t i = 0; i < n; ++i)
                    if (table_.find(t[i]) == kNone && fresh.put(t[i], i) == kNone) ++extra;
                const int64_t after = std::min(cap_, table_.size() + extra);
                if (after > max_rows_)
                    throw std::invalid_argument("cache: " + std::to_string(after) +
                                                " distinct tags would be resident, more than max_rows = " +
                                                std::to_string(max_rows_));
            }
            ++clock_;
            ++stores_;
            // Last occurrence of each tag, in increasing position.
            TagTable seen(std::max<int64_t>(n, 1));
            for (int64_t i = n - 1; i >= 0; --i)
                if (seen.put(t[i], i) == kNone) rows.push_back(i);
            std::reverse(rows.begin(), rows.end());
            if (static_cast<int64_t>(rows.size()) > cap_) rows.erase(rows.begin(), rows.end() - cap_);
            const int64_t m = static_cast<int64_t>(rows.size());
            slots.resize(m);
            for (int64_t j = 0; j < m; ++j) slots[j] = (ptr_ + j) % cap_;
            // Evict the lines the pointer runs over.
            for (int64_t j = 0; j < m; ++j) {
                const int64_t victim = slot_tag_[slots[j]];
                if (victim != kNone) {
                    table_.erase(victim);
                    slot_tag_[slots[j]] = kNone;
                    ++evictions_;
                }
                if (slot_row_[slots[j]] != kNone) {
                    free_.push_back(slot_row_[slots[j]]);
                    slot_row_[slots[j]] = kNone;
                }
            }
            storage.resize(m);
            // Write the new lines; a tag still resident elsewhere loses its old line.
            for (int64_t j = 0; j < m; ++j) {
                const int64_t tag = t[rows[j]], s = slots[j];
                const int64_t old = table_.put(tag, s);
                if (old != kNone) {
                    slot_tag_[old] = kNone;
                    free_.push_back(slot_row_[old]);
                    slot_row_[old] = kNone;
                    ++replaced_;
                }
                int64_t r;
                if (!free_.empty()) {
                    r = free_.back();
                    free_.pop_back();
                } else {
                    r = rows_used_++;
                }
                slot_row_[s] = r;
                storage[j] = r;
                slot_tag_[s] = tag;
                slot_clock_[s] = clock_;
            }
            ptr_ = (ptr_ + m) % cap_;
            lines_stored_ += m;
            received_ += n;
        }
        return py::make_tuple(from_vector(std::move(rows)), from_vector(std::move(slots)),
                              from_vector(std::move(storage)));
    }

    // (hit, storage row) per tag; row = -1 on a miss. Updates the statistics.
    py::tuple lookup(carray<int64_t> tags) {
        require(tags.ndim() == 1, "cache: tags must be 1-D");
        const int64_t n = tags.shape(0);
        const int64_t* t = tags.data();
        auto hit = carray<bool>(static_cast<py::ssize_t>(n));
        auto slot = new_array<int64_t>(n);
        bool* hp = hit.mutable_data();
        int64_t* sp = slot.mutable_data();
        bool negative = false;
        {
            py::gil_scoped_release release;
            std::lock_guard<std::mutex> guard(mu_);
            const int64_t B = static_cast<int64_t>(hist_.size());
            std::vector<int64_t> hist(B, 0);
            int64_t* hh = hist.data();
            int64_t hits = 0, age_sum = 0, age_max = age_max_;
#pragma omp parallel for schedule(static) reduction(+ : hits, age_sum) reduction(max : age_max) \
    reduction(|| : negative) reduction(+ : hh[:B]) if (n > 8192)
            for (int64_t i = 0; i < n; ++i) {
                hp[i] = false;
                sp[i] = kNone;
                if (t[i] < 0) {
                    negative = true;
                    continue;
                }
                const int64_t s = table_.find(t[i]);
                if (s == kNone) continue;
                const int64_t age = clock_ - slot_clock_[s];
                if (!never_expire_ && age > ls_) continue;
                hp[i] = true;
                sp[i] = slot_row_[s];
                ++hits;
                age_sum += age;
                age_max = std::max(age_max, age);
                ++hh[std::min(age, B - 1)];
            }
            if (!negative) {
                lookups_ += n;
                hits_ += hits;
                age_sum_ += age_sum;
                age_max_ = age_max;
                for (int64_t b = 0; b < B; ++b) hist_[b] += hist[b];
            }
        }
        require(!negative, "cache: tags must be >= 0");
        return py::make_tuple(hit, slot);
    }

    // Valid lines oldest first: (tags, slots, ages).
    py::tuple contents() {
        std::lock_guard<std::mutex> guard(mu_);
        std::vector<int64_t> tags, slots, ages;
        for (int64_t j = 0; j < cap_; ++j) {
            const int64_t s = (ptr_ + j) % cap_;
            if (slot_tag_[s] == kNone) continue;
            tags.push_back(slot_tag_[s]);
            slots.push_back(s);
            ages.push_back(clock_ - slot_clock_[s]);
        }
        return py::make_tuple(from_vector(std::move(tags)), from_vector(std::move(slots)),
                              from_vector(std::move(ages)));
    }

    py::dict stats() {
        std::lock_guard<std::mutex> guard(mu_);
        py::dict d;
        d["capacity"] = cap_;
        d["max_rows"] = max_rows_;
        d["rows_used"] = rows_used_;
        d["occupancy"] = table_.size();
        int64_t live = 0;
        for (int64_t s = 0; s < cap_; ++s)
            live += slot_tag_[s] != kNone && (never_expire_ || clock_ - slot_clock_[s] <= ls_);
        d["live"] = live;
        d["clock"] = clock_;
        d["lookups"] = lookups_;
        d["hits"] = hits_;
        d["stores"] = stores_;
        d["received"] = received_;
        d["lines_stored"] = lines_stored_;
        d["evictions"] = evictions_;
        d["replaced"] = replaced_;
        d["age_sum"] = age_sum_;
        d["age_max"] = age_max_;
        d["age_hist"] = hist_;
        return d;
    }

    void reset_stats() {
        std::lock_guard<std::mutex> guard(mu_);
        lookups_ = hits_ = stores_ = received_ = lines_stored_ = evictions_ = replaced_ = age_sum_ = 0;
        age_max_ = 0;
        std::fill(hist_.begin(), hist_.end(), 0);
    }

    void clear() {
        std::lock_guard<std::mutex> guard(mu_);
        table_.clear();
        std::fill(slot_tag_.begin(), slot_tag_.end(), kNone);
        std::fill(slot_clock_.begin(), slot_clock_.end(), 0);
        std::fill(slot_row_.begin(), slot_row_.end(), kNone);
        free_.clear();
        rows_used_ = 0;
        ptr_ = 0;
        clock_ = 0;
    }

    int64_t occupancy() {
        std::lock_guard<std::mutex> guard(mu_);
        return table_.size();
    }
    int64_t clock() {
        std::lock_guard<std::mutex> guard(mu_);
        return clock_;
    }
    int64_t capacity() const { return cap_; }
    int64_t max_rows() const { return max_rows_; }
    int64_t rows_used() {
        std::lock_guard<std::mutex> guard(mu_);
        return rows_used_;
    }
    int64_t life_span() const { return ls_; }
    bool never_expire() const { return never_expire_; }

  private:
    const int64_t cap_, ls_;
    const bool never_expire_;
    const int64_t max_rows_;
    TagTable table_;
    std::vector<int64_t> slot_tag_;    // tag of each slot, -1 when empty or invalidated
    std::vector<int64_t> slot_clock_;  // clock value when the slot was written
    std::vector<int64_t> slot_row_;    // storage row of each slot's line, -1 when none
    std::vector<int64_t> free_;        // storage rows released by evicted / replaced lines
    int64_t rows_used_ = 0;            // storage rows handed out since construction / clear
    int64_t ptr_ = 0, clock_ = 0;
    int64_t lookups_ = 0, hits_ = 0, stores_ = 0, received_ = 0, lines_stored_ = 0, evictions_ = 0,
            replaced_ = 0, age_sum_ = 0, age_max_ = 0;
    std::vector<int64_t> hist_;
    std::mutex mu_;
};

}  // namespace
}  // namespace hpcgnn

PYBIND11_MODULE(_native_cache, m) {
    using namespace hpcgnn;
    m.doc() = "Historical embedding cache directory: FIFO ring of lines plus a hash-table tag directory.";
    py::class_<CacheDirectory>(m, "CacheDirectory")
        .def(py::init<int64_t, int64_t, bool, int64_t, int64_t>(), py::arg("capacity"), py::arg("life_span"),
             py::arg("never_expire"), py::arg("hist_bins"), py::arg("max_rows") = 0)
        .def("store", &CacheDirectory::store, py::arg("tags"))
        .def("lookup", &CacheDirectory::lookup, py::arg("tags"))
        .def("contents", &CacheDirectory::contents)
        .def("stats", &CacheDirectory::stats)
        .def("reset_stats", &CacheDirectory::reset_stats)
        .def("clear", &CacheDirectory::clear)
        .def_property_readonly("occupancy", &CacheDirectory::occupancy)
        .def_property_readonly("clock", &CacheDirectory::clock)
        .def_property_readonly("capacity", &CacheDirectory::capacity)
        .def_property_readonly("max_rows", &CacheDirectory::max_rows)
        .def_property_readonly("rows_used", &CacheDirectory::rows_used)
        .def_property_readonly("life_span", &CacheDirectory::life_span)
        .def_property_readonly("never_expire", &CacheDirectory::never_expire);
    add_thread_control(m);
}
