# Writes a variant of a query-moment file: M^alpha per head (eigen-decomposition), or M + c*mean(diag)*I.
import sys, struct, numpy as np, xxhash
src, dst, kind, val = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
b = open(src, 'rb').read()
hdr = b[:44]
L, H, D, T = struct.unpack('<4q', b[12:44])
m = np.frombuffer(b[44:-8], dtype='<f8').reshape(L, H, D, D).copy()
for l in range(L):
    for h in range(H):
        a = m[l, h]
        if kind == 'pow':
            w, v = np.linalg.eigh(a)
            w = np.clip(w, 0, None) ** val
            a = (v * w) @ v.T
        else:
            a = a + val * np.trace(a) / D * np.eye(D)
        a = (a + a.T) / 2
        m[l, h] = a
out = hdr + m.astype('<f8').tobytes()
out += struct.pack('<Q', xxhash.xxh64(out, seed=0).intdigest())
open(dst, 'wb').write(out)
