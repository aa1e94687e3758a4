//! A byte reader for hand-laid-out fuzz inputs: little-endian integers from the front, zeros
//! once the input is used up. Unlike `arbitrary`'s derived layouts, this one is simple enough
//! that seed inputs can be written by hand (see [`Writer`]).

/// Reads fields off a fuzz input.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data }
    }
    /// Whether everything was read.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.data
    }
    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }
    fn le<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let b = self.bytes(N);
        out[..b.len()].copy_from_slice(b);
        out
    }
    pub fn u8(&mut self) -> u8 {
        self.le::<1>()[0]
    }
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.le())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.le())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.le())
    }
}

/// Writes inputs in [`Reader`]'s layout (for seeds).
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
}
