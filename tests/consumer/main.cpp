// Links the installed library and calls it without a GPU: the registered kernels, and an
// invalid problem refused by name (validation runs before any device is touched).
#include <hattn/hattn.h>

#include <cstdio>

int main() {
  const auto kernels = hattn::kernels();
  for (const auto& k : kernels) std::printf("forward kernel: %s\n", k.name.c_str());
  hattn::AttentionProblem empty;  // batch 0: refused
  const hattn::Status s = hattn::forward(empty);
  std::printf("forward(empty problem): %s\n", s.to_string().c_str());
  return !kernels.empty() && s.code() == hattn::StatusCode::invalid_argument ? 0 : 1;
}
