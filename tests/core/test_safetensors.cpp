// safetensors parser, memory-mapped reader and writer: round trips and the malformed-input matrix.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "core/st_test_util.hpp"
#include "k3/safetensors.hpp"

namespace k3::st {
namespace {

using test::st_image;
using test::TempDir;
using test::write_bytes;

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 1) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Parses `img` as "bad.safetensors" and returns the error message (empty when it parsed).
std::string parse_error(const std::vector<uint8_t>& img) {
  auto r = parse_header(img, "bad.safetensors");
  return r ? std::string() : r.status().message();
}

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg)

TEST(SafetensorsDType, NamesSizesAndParsingAgree) {
  const DType all[] = {DType::kBool, DType::kU8,  DType::kI8,  DType::kU16,    DType::kI16,
                       DType::kU32,  DType::kI32, DType::kU64, DType::kI64,    DType::kF16,
                       DType::kBF16, DType::kF32, DType::kF64, DType::kF8E4M3, DType::kF8E5M2};
  const int sizes[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8, 1, 1};
  for (size_t i = 0; i < std::size(all); ++i) {
    EXPECT_EQ(dtype_size(all[i]), sizes[i]) << dtype_name(all[i]);
    auto back = parse_dtype(dtype_name(all[i]));
    ASSERT_TRUE(back) << back.status().to_string();
    EXPECT_EQ(back.value(), all[i]);
  }
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  EXPECT_STREQ(dtype_name(DType::kBF16), "BF16");
  auto bad = parse_dtype("F4");
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.status().message(), "'F4' is unknown");
}

TEST(SafetensorsParse, HandBuiltImageParsesInDataOrder) {
  // Header lists "b" first but its bytes come second: tensors() follows the data.
  const std::string h =
      R"({"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]},)"
      R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"__metadata__":{"format":"pt"}})";
  std::map<std::string, std::string> meta;
  auto r = parse_header(st_image(h, iota_bytes(16)), "x.safetensors", &meta);
  ASSERT_TRUE(r) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].name, "a");
  EXPECT_EQ((*r)[1].name, "b");
  EXPECT_EQ((*r)[1].dtype, DType::kBF16);
  EXPECT_EQ((*r)[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*r)[1].numel(), 6);
  EXPECT_EQ((*r)[1].nbytes(), 12);
  EXPECT_EQ(meta.at("format"), "pt");
}

TEST(SafetensorsParse, ScalarsZeroSizedTensorsAndGapsAreValid) {
  const std::string h =
      R"({"s":{"dtype":"F32","shape":[],"data_offsets":[8,12]},)"
      R"("z":{"dtype":"F32","shape":[0,5],"data_offsets":[9,9]},)"
      R"("big_zero":{"dtype":"F64","shape":[0,9223372036854775807],"data_offsets":[0,0]}})";
  auto r = parse_header(st_image(h, iota_bytes(12)), "x.safetensors");
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->size(), 3u);
}

// ---- the malformed-input matrix: each error names the file, the tensor and the problem --------

TEST(SafetensorsMalformed, TruncatedBeforeTheLength) {
  const std::vector<uint8_t> img = {1, 2, 3, 4, 5};
  const auto m = parse_error(img);
  EXPECT_HAS(m, "bad.safetensors");
  EXPECT_HAS(m, "5 bytes, too short");
  EXPECT_FALSE(parse_header({}, "empty.safetensors"));
}

TEST(SafetensorsMalformed, TruncatedData) {
  const std::string h = R"({"w":{"dtype":"U8","shape":[4,4],"data_offsets":[0,16]}})";
  auto img = st_image(h, iota_bytes(16));
  ASSERT_EQ(parse_error(img), "");
  img.erase(img.end() - 3, img.end());  // drop the last 3 data bytes
  const auto m = parse_error(img);
  EXPECT_HAS(m, "bad.safetensors: tensor 'w'");
  EXPECT_HAS(m, "data_offsets [0, 16] end past the data section of 13 bytes");
  auto r = parse_header(img, "bad.safetensors");
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfRange);
}

TEST(SafetensorsMalformed, HeaderLengthPastTheEnd) {
  const std::string h = R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const auto m = parse_error(st_image(h, {7}, h.size() + 100));
  EXPECT_HAS(m, "bad.safetensors: header length " + std::to_string(h.size() + 100) + " runs past the end");
}

TEST(SafetensorsMalformed, AbsurdHeaderSize) {
  const auto m = parse_error(st_image("{}", {}, 200'000'000));
  EXPECT_HAS(m, "bad.safetensors: header length 200000000 exceeds the limit of 100000000");
  const auto m2 = parse_error(st_image("{}", {}, UINT64_MAX - 1));
  EXPECT_HAS(m2, "exceeds the limit");
}

TEST(SafetensorsMalformed, InvalidJson) {
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8",)")), "bad.safetensors: header is not valid JSON");
  EXPECT_HAS(parse_error(st_image("\xff\xfe{}")), "not valid JSON");
  EXPECT_HAS(parse_error(st_image(std::string(100, '[') + std::string(100, ']'))), "nests 100 levels deep");
}

TEST(SafetensorsMalformed, NonObjectHeader) {
  EXPECT_HAS(parse_error(st_image("[1, 2]")), "bad.safetensors: header must be a JSON object, got array");
  EXPECT_HAS(parse_error(st_image("\"str\"")), "got string");
}

TEST(SafetensorsMalformed, UnknownDtype) {
  const auto m = parse_error(st_image(R"({"w":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", {0}));
  EXPECT_HAS(m, "bad.safetensors: tensor 'w': dtype 'F7' is unknown");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", {0})),
             "tensor 'w': \"dtype\" must be a string");
}

TEST(SafetensorsMalformed, OffsetsOutOfRange) {
  const auto m = parse_error(st_image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[10,14]}})", iota_bytes(8)));
  EXPECT_HAS(m, "bad.safetensors: tensor 'w': data_offsets [10, 14] end past the data section of 8 bytes");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[5,4]}})", iota_bytes(8))),
             "tensor 'w': data_offsets [5, 4] have begin > end");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", iota_bytes(8))),
             "tensor 'w': data_offsets [-1,0] must be non-negative integers");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", iota_bytes(8))),
             "tensor 'w': \"data_offsets\" must be an array [begin, end]");
  EXPECT_HAS(parse_error(st_image(
                 R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})")),
             "must be non-negative integers");
}

TEST(SafetensorsMalformed, OverlappingTensors) {
  const std::string h =
      R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})";
  const auto m = parse_error(st_image(h, iota_bytes(16)));
  EXPECT_HAS(m, "bad.safetensors: tensor 'b': data_offsets [6, 10] overlap tensor 'a' [0, 8]");
  // Containment behind a short tensor: c sits inside a although b starts in between.
  const std::string h2 =
      R"({"a":{"dtype":"U8","shape":[12],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
      R"("c":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})";
  EXPECT_HAS(parse_error(st_image(h2, iota_bytes(16))), "overlap tensor 'a'");
  // Same range twice.
  const std::string h3 =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_HAS(parse_error(st_image(h3, iota_bytes(4))), "tensor 'b': data_offsets [0, 4] overlap tensor 'a'");
}

TEST(SafetensorsMalformed, ShapeNotMatchingByteSize) {
  const auto m = parse_error(st_image(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", iota_bytes(8)));
  EXPECT_HAS(m, "bad.safetensors: tensor 'w': shape [2, 3] x BF16 needs 12 bytes but data_offsets [0, 8] hold 8");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
                                  iota_bytes(8))),
             "tensor 'w': shape [4294967296, 4294967296] x U8 overflows");
}

TEST(SafetensorsMalformed, NegativeAndNonIntegerDims) {
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[-2,2],"data_offsets":[0,4]}})", iota_bytes(4))),
             "bad.safetensors: tensor 'w': shape[0] = -2 must be a non-negative integer");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[2,1.5],"data_offsets":[0,3]}})", iota_bytes(4))),
             "tensor 'w': shape[1] = 1.5 must be a non-negative integer");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":"2","data_offsets":[0,2]}})", iota_bytes(4))),
             "tensor 'w': \"shape\" must be an array");
}

TEST(SafetensorsMalformed, DuplicateNames) {
  const std::string h =
      R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})";
  EXPECT_HAS(parse_error(st_image(h, iota_bytes(4))), "bad.safetensors: tensor 'w': name appears more than once");
}

TEST(SafetensorsMalformed, MissingFieldsBadEntriesAndMetadata) {
  EXPECT_HAS(parse_error(st_image(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", {0})), "tensor 'w': missing \"dtype\"");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", {0})), "tensor 'w': missing \"shape\"");
  EXPECT_HAS(parse_error(st_image(R"({"w":{"dtype":"U8","shape":[1]}})", {0})), "tensor 'w': missing \"data_offsets\"");
  EXPECT_HAS(parse_error(st_image(R"({"w":[1,2]})")), "tensor 'w': entry must be a JSON object");
  EXPECT_HAS(parse_error(st_image(R"({"__metadata__":{"k":1}})")), "\"__metadata__\" entry 'k' must be a string");
  EXPECT_HAS(parse_error(st_image(R"({"__metadata__":[]})")), "\"__metadata__\" must be an object");
  EXPECT_HAS(parse_error(st_image(R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})")), "empty name");
}

// ---- writer and memory-mapped reader ----------------------------------------------------------

TEST(SafetensorsFile, WriterRoundTripsThroughTheMappedReader) {
  TempDir dir("st_roundtrip");
  Writer w;
  const auto a = iota_bytes(5 * 7);        // [5, 7] U8: odd size, the next tensor is unaligned
  const auto b = iota_bytes(3 * 2 * 2, 9);  // [3, 2] BF16
  const std::vector<uint8_t> scalar = {0, 0, 128, 63};  // 1.0f
  ASSERT_TRUE(w.add("layer.a", DType::kU8, {5, 7}, a).is_ok());
  ASSERT_TRUE(w.add("layer.b", DType::kBF16, {3, 2}, b).is_ok());
  ASSERT_TRUE(w.add("s", DType::kF32, {}, scalar).is_ok());
  ASSERT_TRUE(w.add("empty", DType::kI64, {0, 3}, {}).is_ok());
  ASSERT_TRUE(w.add_deferred("deferred", DType::kI32, {2, 2}, [](std::span<uint8_t> out) {
                 for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(200 + i);
                 return Status::ok();
               }).is_ok());
  w.set_metadata({{"format", "pt"}, {"producer", "k3"}});
  EXPECT_EQ(w.data_bytes(), 35 + 12 + 4 + 0 + 16);
  const auto path = dir.file("x.safetensors");
  ASSERT_TRUE(w.write(path).is_ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  auto f = File::open(path);
  ASSERT_TRUE(f) << f.status().to_string();
  const File file = std::move(f.value());  // views stay valid across a move
  EXPECT_EQ(file.path(), path);
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.tensors()[0].name, "layer.a");  // insertion order = data order
  EXPECT_EQ(file.metadata().at("producer"), "k3");
  const auto* ta = file.find("layer.a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{5, 7}));
  auto va = file.bytes(*ta);
  EXPECT_TRUE(std::equal(va.begin(), va.end(), a.begin(), a.end()));
  auto vb = file.bytes(*file.find("layer.b"));
  EXPECT_TRUE(std::equal(vb.begin(), vb.end(), b.begin(), b.end()));
  EXPECT_EQ(file.find("layer.b")->dtype, DType::kBF16);
  EXPECT_EQ(file.find("s")->shape.size(), 0u);
  EXPECT_EQ(file.bytes(*file.find("empty")).size(), 0u);
  auto vd = file.bytes(*file.find("deferred"));
  ASSERT_EQ(vd.size(), 16u);
  EXPECT_EQ(vd[15], 215);
  EXPECT_EQ(file.find("nope"), nullptr);
  // The data section starts 8-byte aligned (header padded with spaces).
  uint64_t header_len = 0;
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  // A foreign TensorInfo pointing past the file gives an empty view, never an out-of-bounds one.
  TensorInfo foreign;
  foreign.begin = 0;
  foreign.end = 1 << 20;
  EXPECT_TRUE(file.bytes(foreign).empty());
}

TEST(SafetensorsFile, WriterRejectsBadTensors) {
  Writer w;
  ASSERT_TRUE(w.add("a", DType::kU8, {2}, iota_bytes(2)).is_ok());
  auto s = w.add("a", DType::kU8, {2}, iota_bytes(2));
  EXPECT_HAS(s.message(), "tensor 'a' added twice");
  s = w.add("b", DType::kBF16, {2, 3}, iota_bytes(11));
  EXPECT_HAS(s.message(), "tensor 'b': shape [2, 3] x BF16 needs 12 bytes, got 11");
  s = w.add("c", DType::kU8, {-1, 3}, {});
  EXPECT_HAS(s.message(), "tensor 'c': shape [-1, 3] has a negative dim");
  EXPECT_FALSE(w.add("__metadata__", DType::kU8, {0}, {}).is_ok());
  EXPECT_FALSE(w.add("", DType::kU8, {0}, {}).is_ok());
  EXPECT_FALSE(w.add_deferred("d", DType::kU8, {1}, nullptr).is_ok());
  EXPECT_HAS(w.add_deferred("huge", DType::kF32, {1 << 20, 1 << 10}, [](std::span<uint8_t>) { return Status::ok(); })
                 .message(),
             "deferred tensor 'huge' of 4294967296 bytes exceeds the 1073741824-byte limit of one fill");
  EXPECT_HAS(w.add("bad\xff", DType::kU8, {0}, {}).message(), "not valid UTF-8");
  EXPECT_EQ(w.size(), 1u);
  w.set_metadata({{"k", "\xfe"}});
  EXPECT_HAS(w.write("/nonexistent/never.safetensors").message(), "metadata is not valid UTF-8");
}

TEST(SafetensorsFile, FailedFillLeavesNoFile) {
  TempDir dir("st_fill");
  Writer w;
  ASSERT_TRUE(w.add_deferred("d", DType::kU8, {4}, [](std::span<uint8_t>) {
                 return invalid_argument("generator refused");
               }).is_ok());
  const auto path = dir.file("x.safetensors");
  auto s = w.write(path);
  EXPECT_HAS(s.message(), "generator refused");
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  EXPECT_HAS(w.write(dir.file("no/such/dir/x.safetensors")).message(), "cannot create");
}

TEST(SafetensorsFile, OpenErrorsNameTheFile) {
  TempDir dir("st_open");
  auto r = File::open(dir.file("missing.safetensors"));
  ASSERT_FALSE(r);
  EXPECT_HAS(r.status().message(), "missing.safetensors: cannot open");
  r = File::open(dir.str());
  EXPECT_HAS(r.status().message(), "not a regular file");
  write_bytes(dir.file("empty.safetensors"), {});
  r = File::open(dir.file("empty.safetensors"));
  EXPECT_HAS(r.status().message(), "empty.safetensors: file is 0 bytes");
  write_bytes(dir.file("bad.safetensors"),
              st_image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", iota_bytes(3)));
  r = File::open(dir.file("bad.safetensors"));
  EXPECT_HAS(r.status().message(), dir.file("bad.safetensors") + ": tensor 'w': data_offsets [0, 4] end past");
}

TEST(SafetensorsFile, ReadsTheReferenceWritersOutput) {
  // Written by PyPI `safetensors` 0.8.0 (scripts/make_fuzz_corpus.py): header padded with
  // spaces, tensors ordered by alignment, a zero-size tensor and a scalar.
  auto f = File::open(std::string(K3_TEST_DATA_DIR) + "/safetensors_corpus/valid_reference_writer.safetensors");
  ASSERT_TRUE(f) << f.status().to_string();
  EXPECT_EQ(f->metadata().at("format"), "np");
  ASSERT_EQ(f->tensors().size(), 4u);
  const auto* a = f->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kU8);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{3, 4}));
  const auto va = f->bytes(*a);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(va[i], i);
  const auto vb = f->bytes(*f->find("b"));  // [2, 5] F32, all 1.5
  ASSERT_EQ(vb.size(), 40u);
  for (size_t i = 0; i < 10; ++i) {
    float x;
    std::memcpy(&x, vb.data() + 4 * i, 4);
    EXPECT_EQ(x, 1.5f);
  }
  double s;
  std::memcpy(&s, f->bytes(*f->find("s")).data(), 8);
  EXPECT_EQ(s, 3.0);
  EXPECT_EQ(f->find("c")->shape, (std::vector<int64_t>{0, 3}));
}

// ---- checkpoints ------------------------------------------------------------------------------

void write_shard(const std::string& path, const std::vector<std::string>& names, uint8_t fill) {
  Writer w;
  for (const auto& n : names) {
    ASSERT_TRUE(w.add(n, DType::kU8, {2, 2}, std::vector<uint8_t>(4, fill)).is_ok());
  }
  ASSERT_TRUE(w.write(path).is_ok());
}

TEST(SafetensorsCheckpoint, SingleFileAndItsDirectory) {
  TempDir dir("ckpt_single");
  write_shard(dir.file("model.safetensors"), {"a", "b"}, 3);
  auto c = Checkpoint::open(dir.file("model.safetensors"));
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->directory(), dir.str());
  EXPECT_EQ(c->tensor_names(), (std::vector<std::string>{"a", "b"}));
  auto hit = c->find("b");
  ASSERT_TRUE(hit);
  EXPECT_EQ(hit->first->bytes(*hit->second)[0], 3);
  auto miss = c->find("zzz");
  ASSERT_FALSE(miss);
  EXPECT_HAS(miss.status().message(), "tensor 'zzz' is not in checkpoint");
  // The directory itself (no index): every *.safetensors file.
  auto d = Checkpoint::open(dir.str());
  ASSERT_TRUE(d) << d.status().to_string();
  EXPECT_TRUE(d->contains("a"));
}

TEST(SafetensorsCheckpoint, ShardedThroughTheIndexOpensLazily) {
  TempDir dir("ckpt_index");
  write_shard(dir.file("model-00001-of-00002.safetensors"), {"x.0", "x.1"}, 1);
  write_shard(dir.file("model-00002-of-00002.safetensors"), {"x.2"}, 2);
  test::write_text(dir.file("model.safetensors.index.json"),
                   R"({"metadata":{"total_size":12},"weight_map":{"x.0":"model-00001-of-00002.safetensors",)"
                   R"("x.1":"model-00001-of-00002.safetensors","x.2":"model-00002-of-00002.safetensors"}})");
  auto c = Checkpoint::open(dir.str());
  ASSERT_TRUE(c) << c.status().to_string();
  EXPECT_EQ(c->tensor_names().size(), 3u);
  EXPECT_EQ(c->shard_files().size(), 2u);
  // Corrupt the second shard after opening: only a lookup that needs it fails, naming it.
  write_bytes(dir.file("model-00002-of-00002.safetensors"), {1, 2, 3});
  auto ok = c->find("x.1");
  ASSERT_TRUE(ok) << ok.status().to_string();
  EXPECT_EQ(ok->first->bytes(*ok->second)[0], 1);
  auto bad = c->find("x.2");
  ASSERT_FALSE(bad);
  EXPECT_HAS(bad.status().message(), "model-00002-of-00002.safetensors: file is 3 bytes");
}

TEST(SafetensorsCheckpoint, IndexErrors) {
  TempDir dir("ckpt_index_err");
  write_shard(dir.file("s1.safetensors"), {"a"}, 1);
  const auto index = dir.file("model.safetensors.index.json");
  test::write_text(index, R"({"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  auto c = Checkpoint::open(dir.str());
  ASSERT_FALSE(c);
  EXPECT_HAS(c.status().message(), "shard 's2.safetensors' (holding 1 tensors) is missing");

  test::write_text(index, R"({"weight_map":{"a":"../s1.safetensors"}})");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "tensor 'a': shard \"../s1.safetensors\" must be a file name");
  test::write_text(index, R"({"weight_map":[]})");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "\"weight_map\" must be an object");
  test::write_text(index, R"({"metadata":{}})");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "missing \"weight_map\"");
  test::write_text(index, R"({"weight_map":{"a":)" + std::string(5000, '[') + std::string(5000, ']') + "}}");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "JSON nests 5002 levels deep (limit 64)");
  test::write_text(index, R"({"weight_map":{"a":[1,2]}})");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "tensor 'a': shard [1,2] must be a file name");
  test::write_text(index, "{nope");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "model.safetensors.index.json: not valid JSON");

  test::write_text(index, R"({"weight_map":{"a":"s1.safetensors","ghost":"s1.safetensors"}})");
  auto g = Checkpoint::open(dir.str());
  ASSERT_TRUE(g) << g.status().to_string();
  EXPECT_HAS(g->find("ghost").status().message(), "tensor 'ghost': ");
  EXPECT_HAS(g->find("ghost").status().message(), "maps it to shard 's1.safetensors', which does not hold it");
}

TEST(SafetensorsCheckpoint, FolderErrors) {
  TempDir dir("ckpt_folder");
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(), "holds neither model.safetensors.index.json nor any");
  EXPECT_HAS(Checkpoint::open(dir.file("nothing")).status().message(), "no such file or directory");
  write_shard(dir.file("a.safetensors"), {"t", "u"}, 1);
  write_shard(dir.file("b.safetensors"), {"t"}, 2);
  EXPECT_HAS(Checkpoint::open(dir.str()).status().message(),
             "tensor 't' appears in both a.safetensors and b.safetensors");
}

}  // namespace
}  // namespace k3::st
